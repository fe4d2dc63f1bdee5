import sys

from vllm_neuron.cli import main

sys.exit(main())

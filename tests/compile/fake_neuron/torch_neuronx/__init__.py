"""Fake torch_neuronx (tests/compile/fake_neuron): only what the Neuron toolchain lowers with."""

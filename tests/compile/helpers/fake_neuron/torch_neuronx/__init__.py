"""Fake torch_neuronx (tests/compile/helpers/fake_neuron): only what the Neuron toolchain
lowers with."""

"""CPU kernels for the transformers engine, and their exactness probes: packed and int8 linears, the row-exact
attention, the greedy screen of the LM head, the LM-head tap, the masks of each attention layer type."""

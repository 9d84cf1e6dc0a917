"""The wire: every record and message that crosses the network (typed `WireRecord`s), their codec,
tensors in parts, and the prompt's prefix keys. Pure data; imports only `petals_chain.errors`."""

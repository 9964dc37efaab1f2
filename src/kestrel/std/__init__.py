"""The standard library: ops (a shape rule and a torch kernel each) and standard blocks."""

"""Isolated execution of model-written code: one Sandbox protocol, backends local
(Linux namespaces), docker and e2b. Being built; the package exists so the layout and
the distribution are fixed from the start."""

"""The CPU side: the C expert executor's binding (``executor``) and the CPU branch of a layer call (``branch``)."""

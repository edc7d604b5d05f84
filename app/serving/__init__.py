"""The worker thread that owns the models, the jobs it serves, and which pairs may load."""

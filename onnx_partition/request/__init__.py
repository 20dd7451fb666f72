"""A verb's request resolved from the user's options: the command line and the Python API
resolve alike."""

"""Text corpora bundled with the package (read through ``importlib.resources``)."""

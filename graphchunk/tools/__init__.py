"""The command-line programs of ``[project.scripts]`` (``graphchunk-model`` is ``reference/models.py``)."""

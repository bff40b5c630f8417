"""This project's published studies: report writers over committed results.

The library (``longctx``) is what a user of the framework imports to train and evaluate. ``studies``
holds this project's own analyses (the position and packing ablations, the RULER suite per arm, the
context extension, the associative-recall study, the archive of a sweep's results): they read
finished runs and write the tables, figures and JSON under ``docs/``. They use the library; the
library never imports them (an import-linter contract in pyproject.toml holds this).
"""

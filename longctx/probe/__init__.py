"""The leak probe: prove that packed documents stay apart for a run's exact model, backend,
precision and parallel layout.

``python -m longctx.probe [overrides as train.py takes]`` (longctx.probe.cli), or in a run with
``callbacks=probe`` (longctx.probe.callback.LeakProbe). The checks themselves are pure functions
in longctx.probe.checks; docs/leak-probe.md shows the tables.
"""

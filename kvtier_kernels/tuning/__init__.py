"""Per-device tuning of the kernels' launch parameters: the files, the lookup the
launchers read, and the sweep that writes the files.

- :mod:`~kvtier_kernels.tuning.files`: which ops are tunable (:class:`Tunable`), how files
  are named, read and checked;
- :mod:`~kvtier_kernels.tuning.lookup`: the search path and :func:`tuned_config`, which
  every tunable launcher calls (packaged defaults in ``tuned/`` beside it);
- :mod:`~kvtier_kernels.tuning.sweep`: ``kvtier tune``'s pipeline (check, time, write);
- :mod:`~kvtier_kernels.tuning.shapes`: :class:`ModelShape`, the KV geometry swept for;
- :mod:`~kvtier_kernels.tuning.problem`: what every sweep entry shares;
- :mod:`~kvtier_kernels.tuning.paged`, :mod:`~kvtier_kernels.tuning.rope`: the sweep
  entries, one per op;
- :mod:`~kvtier_kernels.tuning.copy_engine`: the copy-engine crossover.

Adding a tunable op: its op file declares a ``Tunable`` with ``files.register_tunable``
and reads its tuned config with ``lookup.tuned_config``; its sweep entry is a module here
plus one line in ``sweep.SWEEPS``.

NOTE: this package's ``__init__`` imports nothing: the launchers import ``files`` and
``lookup`` from inside their op modules, and the sweep imports the op modules, so the
sweep must not load with them.
"""

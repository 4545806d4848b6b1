"""The ``kvtier`` subcommands, one module each; :mod:`kvtier.cli` assembles them.

Each module has ``HELP`` (its line in ``kvtier --help``), ``DESCRIPTION`` (the text above
its own ``--help``, or None), ``add_arguments(parser)`` and ``run(args) -> int`` (the exit
code). ``model_shape`` holds the model-shape flags that precompile and tune share.
"""

"""The `gpn` console script (`python -m modeling_gpn.cli`): one subcommand per job.

The command itself lives in the top-level `gpn_cli` package, outside `modeling_gpn`, so that `gpn --help` does not
pay for this package's `__init__` (torch and transformers, to register GPN with the Auto classes); its names stay
importable from here, where users and scripts have always found them.
"""

from gpn_cli import SUBCOMMANDS, available_subcommands, build_parser, main, version_line

__all__ = ["SUBCOMMANDS", "available_subcommands", "build_parser", "main", "version_line"]

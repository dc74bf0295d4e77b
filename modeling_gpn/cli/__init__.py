"""What the `gpn` subcommands share: the tools' argument checks (`arguments`), the loading of a model folder with its
weights checked (`loading`), the weights' dtypes and the quantization behind `--dtype int8 | int4` of gpn generate,
eval and bench (`quantization`), the help formatter (`formatting`), and `gpn generate` (`generate`). The command
itself (`main`, `build_parser`, `SUBCOMMANDS`; `python -m gpn_cli`) is the
top-level `gpn_cli` package, outside `modeling_gpn`, so that `gpn --help` does not pay for this package's
`__init__` (torch and transformers, to register GPN with the Auto classes); nothing here imports it back.
"""

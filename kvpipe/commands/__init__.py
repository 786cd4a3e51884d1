"""The commands the CLI (kvpipe/cli.py) defines itself, one module each with `add_args(parser)`
and `run(args, extra) -> int`, and the server flags two of them share.

flags.py       the server's flags (SGLang's names; SGLANG_* variables as defaults) -> ServerConfig
serve.py       `kvpipe serve`: an HTTP server, colocated or one half of a PD pair
generate.py    `kvpipe generate`: one-shot generation without a server
init_model.py  `kvpipe init-model`: write a built-in preset checkpoint directory
launch.py      `kvpipe launch`: a local PD stack (kvpipe/launch) started, supervised, stopped
"""

"""`gpn serve`: a GPN behind an OpenAI-compatible API, on transformers' own server (`transformers serve`),
where each conversation's whole context is one kept state.

- `server.GPNServe`: transformers' `Serve`, built with the two handlers below, its model manager able to build a GPN.
- `handlers`: transformers' chat and completion handlers with request checks, limits, `n` answers and the
  state store around them.
- `generation.StateKeepingModel`: where a request becomes a `generate()` call through the state store.
- `state_store.StateStore`: the bounded store of states keyed by the token ids they have read.
- `validation`: checks of OpenAI request bodies; `models`: the model manager's view of transformers, with GPN.
- `prepared`: a request's prompt rendered and tokenized in a worker thread, handed to transformers' handler
  (which would make it on the event loop).
- `stop_strings`: answers cut before their stop sequence, and generation ended there; `streaming`: transformers'
  streamer sending the answer's whole text (runs of byte tokens once they end); `errors`: errors in the OpenAI
  API's shape.
- `cli`: the `gpn serve` command. See docs/serving.md.
"""

# Defaults of `gpn serve` (and `GPNServe`), here so that `gpn serve --help` needs no serving dependency.
DEFAULT_STATE_STORE_BYTES = 1 << 30
DEFAULT_STATE_DIR_BYTES = 10 << 30
DEFAULT_MAX_CONTEXT = 131_072
DEFAULT_MAX_QUEUED_REQUESTS = 64
# A request's body is read whole into memory, and its prompt tokenized on the server's event loop, before any
# other limit applies: 4 MiB holds a prompt of the default --max-context (131,072 tokens, about 0.5 MB of English
# text) several times over, and bounds the time a hostile body holds the other requests (tokenizing 4 MiB as one
# text takes seconds: benchmarks/RESULTS.md).
DEFAULT_MAX_REQUEST_BYTES = 4 << 20

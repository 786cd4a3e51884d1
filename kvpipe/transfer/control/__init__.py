"""Control plane between prefill and decode ranks: who talks to whom, and in what words.

`messages.py` holds the typed, versioned messages (RegisterPeer, TransferRequest,
TransferStatus, ...) and `codec.py` their strict msgpack form; `endpoint.py` is the ZeroMQ
endpoint every rank owns (one PULL socket in, one PUSH socket per peer out); `bootstrap.py` is
the prefill's HTTP bootstrap server, where prefill ranks register their layouts and a decode
looks them up (`bootstrap_info.py` what it holds, `bootstrap_client.py` its client);
`bootstrap_address.py` parses the address a request names strictly, and `fetch_guard.py` decides
where a decode may fetch from;
`auth.py` signs and checks bootstrap calls and control frames with the deployment's shared
secret; `handshake.py` is what a prefill and a decode must agree on (model digest, KV dtype, page
size, layout, fp8 scales, state layout, speculative settings) and the refusal of a mismatch.
Nothing here moves KV bytes.
"""

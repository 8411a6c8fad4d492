"""Several HTTP processes in front of one set of engines (``--http-processes N``, N > 1).

One HTTP process tops out at a few thousand requests a second per core (docs/performance.md, "The front
end's ceiling"): less than a fast GPU serves. The server's first process keeps the engines (host.py) and
starts N front-end processes (frontend.py) that share the listening socket it bound first; each runs the
same app (HTTP, auth, validation, the text side's checks and tokenization, response encoding) over
`RemoteEngine`s, which pass each call to the engine process over a channel of typed messages (channel.py).
/metrics is answered by the engine process, with the front ends' HTTP series summed in (series.py).
"""

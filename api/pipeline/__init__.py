"""What every HTTP door shares, once, in three parts: intake (`intake.py`: reading and
checking a body, acquiring its model, running the door's handler with the request's
`RequestContext`, answering errors), start (`start.py`: a door's request into an engine
request, `Call` -> `Started`) and output (`output.py`: the model's output split (reasoning,
tool calls) into pieces, the one stream writer: numbered frames, pings, disconnects,
resume), with the error catalogue. A door translates its wire format into a `Call` and
renders `Piece`s back. Embeddings and rerank (`embed.py`, `rerank.py`) are a call's inputs
checked and run as prefill-only engine requests, with their vectors or scores back."""

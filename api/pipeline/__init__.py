"""What every HTTP door shares, once: reading and checking a body, turning a door's request
into an engine request (`Call` -> `Started`), splitting the model's output (reasoning, tool
calls), the one stream writer (numbered frames, pings, disconnects, resume) and the error
catalogue. A door translates its wire format into a `Call` and renders `Piece`s back."""

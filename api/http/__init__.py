"""The HTTP server: the app and its routes (`app`), the guards against hostile clients
(`guard`), what answers while the model loads (`loading`), logging, and the process that
runs uvicorn (`serve`)."""

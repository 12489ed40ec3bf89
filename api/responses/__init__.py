"""The OpenAI Responses door: /v1/responses and the responses it stores."""

"""The HTTP edge: the gateway and its checks, admission, a response's lifetime, choices read and fed, SSE, the
OpenAPI document."""

"""The HTTP layer: routes, request schemas, and the one map from error kinds to status codes."""

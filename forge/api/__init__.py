"""The wire APIs, one folder each: a request's schema, what it becomes for the engine, the output's shapes."""

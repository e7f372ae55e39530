"""Plain data every layer shares: configuration, sampling parameters, requests and their outputs,
roles, errors. Imports neither torch nor Ray."""

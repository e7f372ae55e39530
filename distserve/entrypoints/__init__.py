"""How clients reach a cluster: the gRPC and OpenAI-compatible HTTP servers, their client, and
the ``distserve launch`` process that runs them in front of the orchestrator."""

"""Serving: the OpenAI-compatible server's parts and the refinement viewer's data and page."""

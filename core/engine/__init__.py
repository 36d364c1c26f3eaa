"""The engine loop (``step()`` = schedule → execute → update), its model runner and the offline ``LLM`` API."""

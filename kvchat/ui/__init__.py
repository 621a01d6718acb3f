"""The terminal front end: plain-data views of the cache, Rich renderables, and the chat REPL.

Importing this package imports nothing heavy; `kvchat inspect` relies on that.
"""

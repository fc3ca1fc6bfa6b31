"""Developer tools: code generation and reports (not used at run time)."""

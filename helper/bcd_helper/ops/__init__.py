"""The helper's operations: the OPS table (table.py) and one module per family."""

"""Kind handlers (dispatch.handlers.Handler), one module per kind family.

- inventory: `inventory.refresh`, over an injected InventoryCollector.
- testing: `test.*` kinds that prove the dispatch machinery; registered only by tests and `bcd sim`
  (their rows live in TEST_KINDS, never in dispatch.kinds.KINDS).
"""

"""The converge runner and the types every section reports with.

- types.py: SECTION_ORDER, SectionState, Condition, SectionOutcome, DesiredSpec, SectionStatus, NodeStatus
- section.py: the Section protocol, Observation, PassContext, PartsObserver
- runner.py: ConvergeRunner (a trio service: `await nursery.start(runner.run)`)
- status.py: StatusCell, the latest-wins status sink

See docs/converge.md.
"""

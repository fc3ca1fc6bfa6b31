"""Command dispatch: the kind table, the acceptance checks, lanes and workers, the quorum ledger.

Layout (docs/dispatch.md has the rules and decisions):
- kinds: KINDS, the one literal kind table (lane, roles, flags, timeout), Lane, Role, timeout_for
- command: CommandEnvelope (the delivered command, exact body bytes kept), CommandUpdate, UpdateState,
  RejectReason, InvalidCommand
- wire: envelope_from_wire (strict, once), update_to_wire
- acceptance: precheck(command, AcceptanceContext) -> Accept | Defer | Reject (pure, the seeds' order)
- quorum: QuorumLedger (data_dir/quorum-ledger.json: unbatched allowance window, used batch leaves)
- lanes: LANES (credits/workers), Credits, ResourceLocks
- handlers: Handler, RunContext, CommandFailed, InvalidPayload, CommandCancelled
- results: update_from_entry (the terminal update of a journal entry; also used for replay)
- trust: BundleTrust (TrustView + BatchVerifier over pki), NodeResultSigner
- ports: the Protocols the dispatcher depends on
- dispatcher: Dispatcher, the trio service (`await nursery.start(dispatcher.run)`)
"""

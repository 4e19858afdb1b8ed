"""The supervisor: the control plane of a run (membership, prompt ledger, layout index, policy
version, statistics). It owns no tensor bytes."""

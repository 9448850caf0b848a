"""The node daemon and the `ravnest-node` CLI."""

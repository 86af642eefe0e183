"""The worker shell: what every prefill and decode worker runs around its model (its link to the gateway, the step
loop's common parts, admission, health endpoints, draining, cache events, step-fault triage)."""

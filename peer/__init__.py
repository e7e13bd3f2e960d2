"""The swarmstream node: model, data, inner trainer, outer optimizer, swarm, checkpoints."""

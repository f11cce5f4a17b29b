"""Deploying the roles on Ray: one module a role, above the tiers whose actors they start."""

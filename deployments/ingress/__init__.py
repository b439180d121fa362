"""The router's helpers, one job per module (the Router itself is :mod:`deployments.router`, its
tenancy façade :mod:`deployments.tenancy`):

- :mod:`~deployments.ingress.admission`: who the caller is (``authorization`` metadata, open
  mode's tenant) and what an admitted request holds (:class:`Admission`);
- :mod:`~deployments.ingress.checks`: the checks of a request's metadata and shape before it is
  admitted (session id, application, deadline, message count, characters);
- :mod:`~deployments.ingress.relay`: relaying a draft replica's stream, resuming after its death;
- :mod:`~deployments.ingress.tenant_stats`: ``GetTenantStats``' answer from the shared state.
"""

"""Roles that follow the load: a controller in the orchestrator that moves instances between
colocated and disaggregated (prefill + decode) layouts from the latency SLOs' live attainment.

It judges the current layout by the requests that finished lately and arrived once the layout had
settled, each by its own SLOs or the cluster's, together with those in flight whose TTFT is known;
it remembers how each layout's requests did under each kind of load, and moves to a layout memory
says served the arriving load better; a kind of load memory says nothing of is met by a forecast
from the instances' step times. Patience and a dwell time keep it from flapping. It reads the
cluster through a narrow view (``ClusterView``) that the orchestrator provides.

- ``config``: ``RoleControlConfig``, the ``cluster.role_control`` settings
- ``cluster_view``: ``ClusterView``, what the controller reads of the cluster and changes in it
- ``request_records``: a request as the controller knows it, arrived, in flight and finished
- ``attainment``: how well requests met their SLOs, and how sure a share of them is
- ``load``: ``Load``, what requests asked of the cluster, and kinds of requests
- ``layouts``: the layouts the controller moves between
- ``policy``: ``propose``, the change one window's attainment calls for
- ``settling``: from when a layout's requests count for it
- ``observations``: the requests finished, in flight and arriving
- ``memory``: ``LayoutMemory``, what each layout served under each load, and the changes it vetoes or makes
- ``forecasting``: a layout for a kind of load memory says nothing of
- ``controller``: ``RoleController``, the control loop, with patience and dwell against flapping
"""

"""Every assumption of the fleet model, written once: this docstring is what the report prints.

The simulator's figures are only as good as what it takes for granted, so the
list lives here, as the module's docstring, and :func:`sections` hands the
report the sections that apply to a run. Keeping the text in one place means
the code, ``--help`` and ``report.md`` cannot drift apart. Each ``## `` line
starts a section; each ``- `` line starts an assumption.

## Cluster
- GPU nodes are identical: ``--gpus-per-node`` GPUs of ``--gpu-memory`` each, ``--node-vcpu`` vCPU and
  ``--node-memory`` host memory (default: a DGX H100-class node, 8 x 80 GiB, 224 vCPU, 2 TiB). CPU-only nodes are
  identical too (default 192 vCPU, 1 TiB: enough for the largest DLRM CN instance, 192 vCPU and 960 GiB). With
  ``--openb-nodes`` GPU nodes take the inventory's most common GPU-node shape, and CPU nodes its most common CPU-only
  shape if that holds the workload's largest plain pod and CPU stage (otherwise the default stays, and the report
  says so); a flag that names a size wins over both.
- GPU nodes are tainted: plain CPU-only pods are scheduled to CPU nodes only.
- Without ``--gpu-nodes``/``--cpu-nodes`` the cluster is sized from the workload: every mode is first run on pools
  that grow by one node whenever nothing fits, and all modes then run on the largest pool any of them needed. Bundled
  mode therefore never waits for a node, and the comparison is what the same hardware holds, not a cluster sized to
  favour weft; the nodes each mode needed on its own are reported too.
- Requests equal use: a container uses exactly what it requests (a rerouted CPU stage, its limits); no bursting and
  no idle CPU. A peer's measured use is therefore its own pods' requests plus what it hosts.
- The scheduler binds the first node in index order that fits (a bin-packing scheduler, like MostAllocated), in
  every mode. Pods wait in arrival order, but a pod that fits is never held back by an older pod that does not
  (kube-scheduler retries unschedulable pods; there is no head-of-line blocking). A pod that would not fit even an
  empty node is reported as never placed and left out of the time statistics.
- Node, link and agent failures, image pulls, and the latency of the stitched localhost between a rerouted CPU stage
  and its GPU stage are not modelled: a pod runs for the same time in every mode. The one failure modelled is a GPU
  stage running out of GPU memory (see Out of memory), which restarts its container in place.

## Modes
- bundled: the whole pod (every container's requests, and whole GPUs through ``packing.pack`` with a whole-device
  ask) is bound to one GPU node and holds its GPUs for its whole life.
- weft: each container is described as kubelet's CreateContainer would (the GPU stage carries
  ``NVIDIA_VISIBLE_DEVICES``, the CPU stage does not), classified by ``classify.classify`` and given its reason by
  ``placement.place``; the GPU stage's lease is read by ``placement.gpu_ask`` (``weft.io/gpu-memory.<c>``, compute
  share = memory share unless ``weft.io/gpu-compute.<c>`` says otherwise) and placed by ``packing.pack`` against the
  node's live leases; each CPU stage goes to the peer that ``reroute.decide`` ranks first over PeerViews built by
  ``reroute.free_capacity``, or stays on the GPU node when no CPU node has room, as the agent falls back.
- weft declares the CPU stage's requests small (0.1 vCPU, 256 MiB) and its limits at what it needs,
  so the scheduler books only the GPU stage and that token on the GPU node. weft-full-requests is the same with the
  CPU stage's requests left at full size, so the scheduler books the whole pod on the GPU node: the other way of
  declaring (docs/design.md, "What the scheduler sees").
- weft-reserved: as weft, and each hosted CPU stage has a reservation pod on its host, bound there for the stage's
  life with the requests the stage was admitted by (its limits), as the agent creates one when a host admits a
  shadow (docs/design.md, "What the scheduler sees"). The host's scheduler counts reservation pods like any pod, so
  it binds a plain pod to a CPU node only where that pod fits beside the node's plain pods and reservations, and
  never onto CPU a hosted stage uses. The host admits a stage by the same real free capacity as in weft. The
  reservation is bound at the instant the stage is admitted: the gap between the two in a real cluster (where a
  plain pod bound in between makes kubelet refuse the reservation and the stage be placed afresh), preemption and
  eviction of reservations are not modelled; reservations carry no priority of their own here.
- kai-fractions: KAI scheduler's GPU sharing (a pod's ``gpu-fraction`` or ``gpu-memory`` annotation) as KAI does it
  by default, with no memory limit between the pods on one GPU (its documentation: "By default, KAI Scheduler does
  not enforce memory allocation limits or perform memory isolation between processes"): the pod is bound whole to
  a GPU node as in bundled (every container's requests on the node's books), and its GPU stage holds a share of one
  GPU: the share it declares (``weft.io/gpu-memory.<c>``, sized by ``--lease`` as weft's lease is), read by
  ``placement.gpu_ask`` and placed by ``packing.pack`` exactly as weft's lease, so the two differ in what enforces
  the share alone. KAI's own choice of GPU (its binpack or spread of fractions) is not modelled; a stage that needs
  several GPUs takes whole ones. Nothing holds a stage to its share: it may use what the others on its GPU leave
  (see Out of memory).
- Sharing a GPU between pods needs the device plugin to advertise shared replicas (or a DRA driver with shared
  claims): the model assumes the scheduler binds a weft pod only to a node whose broker can pack its GPU stage, and
  that the broker may use any GPU of that node.
- A lease is held for the GPU container's whole life (bound at createRuntime, released at poststop), so in every mode
  GPU time is held for the pod's life; weft holds a share of a GPU, bundled a whole one.

## Metrics
- GPU utilisation is busy GPU-seconds over held GPU-seconds. Busy is the GPU **duty cycle** (the fraction of time a
  kernel runs, what nvidia-smi and GenTD26 call utilisation), not SM or tensor-core activity, which are lower. Held
  is a GPU with at least one pod or lease on it; GPUs nobody holds are not in the denominator (the utilisation of
  all installed GPUs is reported beside it).
- Busy seconds are the same work in every mode: a GPU stage's series is replayed from the moment its pod starts,
  less the time its container is down after running out of memory (see Out of memory), when it does no work.
  Sharing a GPU does not slow a stage down in the model; where the duty cycles of the stages on one GPU add up to
  more than 100 %, that share of held GPU time is reported as oversubscribed (sampled at 400 evenly spaced
  instants) instead of stretching the work.
- A lease's compute share caps the SMs a client may use (MPS), not its time on the GPU; a duty-cycle sample above
  the share is kept as is.
- Completion time is queueing delay plus run time; a long-running serving pod's run time is its lifetime in the
  trace. Jobs per hour is pods finished over the time from 0 to the last finish.
- CPU-node utilisation is requested vCPU-seconds on CPU nodes (plain pods, and hosted CPU stages by their limits)
  over the CPU nodes' vCPU-seconds. A peer admits a stage by its real free capacity, but in weft and
  weft-full-requests the scheduler does not see hosted stages and may later bind a plain pod on top of them; the
  hosted stages run at low CPU weight, so they lose that CPU, reported as the squeezed share of hosted vCPU-hours
  (vCPU-seconds a CPU node's plain pods and hosted stages use beyond its capacity, over hosted vCPU-seconds; less
  than a millionth of a vCPU over is rounding in the books, not use). In weft-reserved the scheduler counts every
  hosted stage, so the share is 0 by construction (the engine stops with an error if a reserved node ever ran
  over). A CPU stage that fell back to a GPU node whose books held only its token request is reported as
  vCPU-hours over that node's capacity.

## Out of memory
- A GPU stage holds, at each moment, the GPU memory its series says (replayed from its pod's start, as its duty
  cycle is). An allocation fails, and the stage's container with it, where it does not fit: in weft's modes above
  the stage's own lease (MPS caps each client's memory at its lease and the broker's watchdog kills a container
  that holds more), so only the stage that overran fails; in kai-fractions and bundled beyond what its GPU has left
  beside the memory the other stages on it hold now, whoever overran: the stage whose memory grew at that instant
  fails, also when it asked no more than its own share (counted as within its own share: a neighbour's overrun).
  Checked at every change of a stage's memory and at every start of its container; at one instant memory is freed
  first, then taken in the order the leases were.
- A failed container is restarted in place, as kubelet restarts the containers of a serving pod's Deployment
  (restartPolicy Always): after a back-off of 10 s that doubles with each failure to at most 300 s and is reset once
  the container has run 10 minutes. The pod keeps its node, GPU, share and lifetime (a serving pod's run time is its
  lifetime in the trace; in weft the restarted container's new lease is taken to be the one it left). While down,
  the stage holds its share and does no work; restarted, it holds what its series holds then, so a stage still
  above its lease, or beside neighbours that still leave it no room, fails again at once (a crash loop). Re-placing
  the pod instead, or re-running its whole lifetime, would count serving time as lost work. The time a restarted
  server takes to load its model, and the requests in flight when it failed, are not modelled: the GPU-hours lost
  are a lower bound.
- A GenTD26 pod replayed from the summary holds its mean memory throughout, so only pods with a full series ever
  change their memory; a share at the pod's peak (``--lease peak``) is never exceeded, in any mode.
- Reported per mode: failures (each failed start or restart counts), those of stages within their own share, the
  GPU stages that failed at least once, the GPU-hours their shares were held while down (a share is its memory over
  the GPU's; a whole GPU is 1) and the busy GPU-hours their series had in that time (work not done).

## Cost
- The fleet's cost of a mode is the GPU nodes and CPU nodes that mode needs on its own (pools that grow by one node
  whenever nothing fits, so no pod waits and the work is the same in every mode), each paid for the whole run at
  its hourly price: ``--gpu-node-price`` and ``--cpu-node-price``, by default on-demand list prices of AWS
  instances shaped like the default nodes (p5.48xlarge, 8 x H100 80 GB, 192 vCPU, 2 TiB, $55.04/h after AWS's
  June 2025 P5 price cut; r7i.48xlarge, 192 vCPU, 1,536 GiB, $12.7008/h; both us-east-1, Linux). The report states
  the prices and their sources. A node is paid for whether or not it is busy: no autoscaling, no spot or committed
  discounts, no storage, network or licence costs. The squeezed share beside each fleet is measured on that fleet.
- The sizing is first-fit by index order, as the scheduler model binds; a real cluster's packing may need a few
  nodes more or less, in every mode alike. With both node counts given no mode is sized and no cost per mode is
  reported.

## DLRM workload (--dlrm)
- Each row of the Prism trace is one instance. Within each app, each HN (GPU node) instance, in creation order, is
  paired with the unpaired CN (CPU node) instance whose creation and deletion times are nearest its own, if they
  differ by at most a day in total, into one pod: the CN is the pod's CPU stage (container ``cn``, its vCPU and
  memory request), the HN its GPU stage (container ``hn``, its vCPU, memory and GPU request). The trace has no
  pairing of its own; pairing only instances that live at the same time keeps the CPU demand where the trace has it
  (the validation measures the drift), and the one-day window keeps that drift under 1 % on the sample.
- A paired pod arrives at the HN's creation and runs for the HN's lifetime (deletion minus scheduling time). CNs
  left unpaired become plain CPU-only pods with their own lifetimes, on CPU nodes in every mode; HNs left unpaired
  become GPU-only pods.
- An empty creation time is the trace start (t = 0, the instance already existed), an empty scheduling time is the
  creation time, and an empty deletion time is the trace end (the latest time in the file, about 31 days): such pods
  are cut there, as the trace itself is. The trace's own scheduling delays are not replayed; the model makes its own
  queueing.
- The trace has no GPU utilisation: the GPU stage's duty cycle and GPU memory come from GenTD26 (``--genai-pods``,
  ``--genai-summary``), or from ``--duty``/``--stage-gpu-memory`` when no GenTD26 file is given. Mixing the two
  traces is the model's choice: no public trace has both a CPU/GPU split and GPU utilisation.
- ``--duration`` keeps the pods that arrive before it and cuts their runs there.

## GenTD26 GPU behaviour (--genai-pods, --genai-summary)
- Each GPU pod draws one GenTD26 pod (seeded ``random.Random``, with replacement, weighted by the pod's number of
  samples, as the published per-sample figures weigh it) and replays its 57-second duty-cycle and GPU-memory series
  from a random starting sample, wrapping around at the end of the 22.8-hour series for longer lives.
- From ``--genai-summary`` (all 143 pods, means only) a pod is replayed at two levels: 0 % for its share of zero
  samples and, spread evenly among them, the level that gives its mean duty cycle (capped at 100 %), with its mean
  GPU memory throughout. Pods that also appear in ``--genai-pods`` are replayed from their full series instead.
- The GPU stage's memory lease (``weft.io/gpu-memory.<c>``) is the pod's peak GPU memory by default (``--lease
  peak``), rounded up to a whole GiB: MPS caps each client's device memory, so a lease below the pod's peak fails
  the pod's allocations whenever it goes above. ``--lease p99``, ``p95`` or ``mean`` size it lower, and the report
  runs all four, weft and kai-fractions, and says how often the pods would exceed the smaller ones and how many
  out-of-memory failures follow; a summary-only pod has no quantiles, so it keeps its peak for p99 and p95. KAI's
  fractions are declared by the same sizes, so both modes hold the same shares.
- The publishers scaled some GenTD26 metrics when anonymising them: the absolute duty cycle and memory may be scaled;
  their distribution is preserved.

## Synthetic workload (--synthetic)
- Pods arrive as a Poisson process at ``--arrival-rate`` per hour and run for an exponentially distributed time of
  mean ``--run-time``; each has one CPU-stage container (``--cpu-stage``) and one single-GPU GPU-stage container
  (``--gpu-host`` host resources) holding ``--stage-gpu-memory`` of GPU memory throughout, at a constant duty cycle
  drawn per pod from ``--duty`` (a percent, ``uniform:LO,HI`` or ``beta:A,B``), unless ``--genai-pods`` or
  ``--genai-summary`` supply the GPU behaviour.
"""

from __future__ import annotations

import re

_SECTION = re.compile(r"^## (?P<title>.+)$")


def sections() -> dict[str, list[str]]:
    """Section title -> its assumptions, each one line, in the order of the docstring."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in (__doc__ or "").splitlines():
        line = raw.strip()
        match = _SECTION.match(line)
        if match:
            current = out.setdefault(match["title"], [])
        elif current is not None and line.startswith("- "):
            current.append(line[2:])
        elif current is not None and line and current:
            current[-1] += " " + line
    return out

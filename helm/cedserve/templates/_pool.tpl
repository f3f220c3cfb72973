{{/*
Worker pools. Prefill and decode are the same kind of object: `replicas` groups of `groupSize` pods,
each pod running `cedserve worker --role <role>`. Every template here takes
(dict "root" $ "role" "prefill|decode") and reads the pool's values from `.Values.<role>`, so the two
pools cannot drift apart. The contract of the command lines is docs/deploy.md.
*/}}

{{/* Arguments after `cedserve` that do not depend on the group workload. */}}
{{- define "cedserve.pool.args" -}}
{{- $v := index .root.Values .role -}}
- worker
- --role={{ .role }}
- --config=/etc/cedserve/{{ .role }}.toml
{{- include "cedserve.checkpointArgs" .root }}
- --host=0.0.0.0
- --grpc-port={{ $v.ports.grpc }}
- --nixl-port={{ $v.ports.nixl }}
- --metrics-port={{ $v.ports.metrics }}
- --dist-port={{ $v.ports.dist }}
- --advertise-host=$(POD_IP)
- --worker-id=$(POD_NAME)
{{- if gt (int $v.gpusPerPod) 1 }}
- --local-ranks={{ $v.gpusPerPod }}
{{- end }}
{{- if .root.Values.tls.internal.enabled }}
- --health-port={{ $v.ports.health }}
{{- end }}
{{- with $v.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
command + args. LeaderWorkerSet injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX
into every container, and the kubelet expands $(VAR) in args. The StatefulSet fallback has one
StatefulSet of replicas x groupSize pods; a pod's rank is its ordinal modulo groupSize and its
leader is the pod whose ordinal is the group's first, so a POSIX shell derives them from POD_NAME.
*/}}
{{- define "cedserve.pool.command" -}}
{{- $v := index .root.Values .role -}}
{{- if eq (include "cedserve.groupWorkload" .root) "LeaderWorkerSet" -}}
command:
  - cedserve
args:
  {{- include "cedserve.pool.args" . | nindent 2 }}
  - --group-size=$(LWS_GROUP_SIZE)
  - --rank=$(LWS_WORKER_INDEX)
  - --leader-address=$(LWS_LEADER_ADDRESS)
{{- else -}}
{{- $size := int $v.groupSize }}
{{- $leader := printf "%s-$((ORDINAL - RANK)).%s.%s.svc.%s" (include "cedserve.poolName" .) (include "cedserve.poolHeadlessName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
command:
  - /bin/sh
  - -c
  - >-
    ORDINAL="${POD_NAME##*-}"; RANK=$((ORDINAL % {{ $size }}));
    exec cedserve "$@" --group-size={{ $size }} --rank="$RANK" --leader-address="{{ $leader }}"
  - cedserve-{{ .role }}
args:
  {{- include "cedserve.pool.args" . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container resources: the values' resources plus GPU and RDMA requests (limits = requests). */}}
{{- define "cedserve.pool.resources" -}}
{{- $v := index .root.Values .role -}}
{{- $res := deepCopy (default dict $v.resources) }}
{{- $requests := default dict $res.requests }}
{{- $limits := default dict $res.limits }}
{{- if gt (int $v.gpusPerPod) 0 }}
{{- $_ := set $requests $v.gpuResourceName (int $v.gpusPerPod) }}
{{- $_ := set $limits $v.gpuResourceName (int $v.gpusPerPod) }}
{{- end }}
{{- if $v.rdma.enabled }}
{{- $_ := set $requests $v.rdma.resourceName (int $v.rdma.count) }}
{{- $_ := set $limits $v.rdma.resourceName (int $v.rdma.count) }}
{{- end }}
{{- $_ := set $res "requests" $requests }}
{{- $_ := set $res "limits" $limits }}
{{- toYaml $res }}
{{- end }}

{{/* The pod template shared by both workloads and both roles. */}}
{{- define "cedserve.pool.podTemplate" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .role -}}
{{- $ctx := dict "root" $root "component" .role -}}
metadata:
  labels:
    {{- include "cedserve.podLabels" $ctx | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  containers:
    - name: {{ .role }}
      image: {{ include "cedserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- include "cedserve.pool.command" . | nindent 6 }}
      env:
        {{- include "cedserve.podEnv" $root | nindent 8 }}
        - name: UCX_TCP_PORT_RANGE
          value: {{ $v.ucxPortRange | quote }}
        - name: TRITON_CACHE_DIR
          value: /var/cache/cedserve/triton
        - name: TORCHINDUCTOR_CACHE_DIR
          value: /var/cache/cedserve/triton/inductor
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.ports.grpc }}
          protocol: TCP
        - name: nixl
          containerPort: {{ $v.ports.nixl }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.ports.metrics }}
          protocol: TCP
        - name: dist
          containerPort: {{ $v.ports.dist }}
          protocol: TCP
        {{- if $root.Values.tls.internal.enabled }}
        - name: health
          containerPort: {{ $v.ports.health }}
          protocol: TCP
        {{- end }}
      resources:
        {{- include "cedserve.pool.resources" . | nindent 8 }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $probePort := ternary $v.ports.health $v.ports.grpc $root.Values.tls.internal.enabled }}
      {{- include "cedserve.grpcProbes" (dict "port" $probePort "probes" $v.probes) | nindent 6 }}
      {{- include "cedserve.preStopDrain" (dict "port" $probePort "drain" $v.drain "grace" $v.terminationGracePeriodSeconds "what" .role) | nindent 6 }}
      volumeMounts:
        - name: config
          mountPath: /etc/cedserve
          readOnly: true
        - name: shm
          mountPath: /dev/shm
        - name: kernel-cache
          mountPath: /var/cache/cedserve/triton
        - name: kv-transfer-token
          mountPath: /var/run/secrets/cedserve/kv-transfer
          readOnly: true
        {{- with include "cedserve.tlsMounts" (dict "root" $root "planes" (list "internal")) | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "cedserve.checkpointMount" $root }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "cedserve.configMapName" $root }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shm.sizeLimit }}
    - name: kernel-cache
      emptyDir:
        sizeLimit: {{ $v.kernelCache.sizeLimit }}
    - name: kv-transfer-token
      secret:
        secretName: {{ printf "%s-kv-transfer" (include "cedserve.fullname" $root) }}
        defaultMode: 0400
    {{- with include "cedserve.tlsVolumes" (dict "root" $root "planes" (list "internal")) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "cedserve.checkpointVolume" $root }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The pool's workload: a LeaderWorkerSet, or one StatefulSet of replicas x groupSize pods. */}}
{{- define "cedserve.pool.workload" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .role -}}
{{- $ctx := dict "root" $root "component" .role -}}
{{- if eq (include "cedserve.groupWorkload" $root) "LeaderWorkerSet" -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "cedserve.poolName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" $ctx | nindent 4 }}
  {{- with $v.lws.exclusiveTopology }}
  annotations:
    leaderworkerset.sigs.k8s.io/exclusive-topology: {{ . }}
  {{- end }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  startupPolicy: {{ $v.lws.startupPolicy }}
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration:
      maxUnavailable: {{ $v.lws.maxUnavailable }}
      maxSurge: {{ $v.lws.maxSurge }}
  leaderWorkerTemplate:
    size: {{ $v.groupSize }}
    restartPolicy: {{ $v.lws.restartPolicy }}
    workerTemplate:
      {{- include "cedserve.pool.podTemplate" . | nindent 6 }}
{{- else -}}
{{- if and $v.autoscaling.enabled (gt (int $v.groupSize) 1) }}
{{- fail (printf "%s.autoscaling needs groupWorkload LeaderWorkerSet when %s.groupSize > 1: a StatefulSet scales pods, not groups" .role .role) }}
{{- end -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ include "cedserve.poolName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ include "cedserve.poolHeadlessName" . }}
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ mul (int $v.replicas) (int $v.groupSize) }}
  {{- end }}
  # A group's ranks rendezvous with each other: start them together, not one by one.
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  selector:
    matchLabels:
      {{- include "cedserve.selectorLabels" $ctx | nindent 6 }}
  template:
    {{- include "cedserve.pool.podTemplate" . | nindent 4 }}
{{- end }}
{{- end }}

{{/*
Headless Service of a pool: the router discovers workers from its EndpointSlices (port `grpc`,
`conditions.ready`), StatefulSet pods get DNS names under it, the ServiceMonitor scrapes `metrics`.
Not-ready addresses are published so group ranks can reach their leader before it is ready.
*/}}
{{- define "cedserve.pool.headlessService" -}}
{{- $v := index .root.Values .role -}}
{{- $ctx := dict "root" .root "component" .role -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "cedserve.poolHeadlessName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" $ctx | nindent 4 }}
    cedserve.io/metrics: "true"
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "cedserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: grpc
      protocol: TCP
    - name: nixl
      port: {{ $v.ports.nixl }}
      targetPort: nixl
      protocol: TCP
    - name: metrics
      port: {{ $v.ports.metrics }}
      targetPort: metrics
      protocol: TCP
    - name: dist
      port: {{ $v.ports.dist }}
      targetPort: dist
      protocol: TCP
{{- end }}

{{- define "cedserve.pool.pdb" -}}
{{- $v := index .root.Values .role -}}
{{- include "cedserve.pdb" (dict "root" .root "component" .role "name" (include "cedserve.poolName" .) "pdb" $v.pdb) }}
{{- end }}

{{/* HorizontalPodAutoscaler scaling the pool's groups on a queue metric. */}}
{{- define "cedserve.pool.hpa" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .role -}}
{{- $hpa := $v.autoscaling -}}
{{- $ctx := dict "root" $root "component" .role -}}
{{- $lws := eq (include "cedserve.groupWorkload" $root) "LeaderWorkerSet" -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "cedserve.poolName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: {{ ternary "leaderworkerset.x-k8s.io/v1" "apps/v1" $lws }}
    kind: {{ ternary "LeaderWorkerSet" "StatefulSet" $lws }}
    name: {{ include "cedserve.poolName" . }}
  minReplicas: {{ $hpa.minReplicas }}
  maxReplicas: {{ $hpa.maxReplicas }}
  metrics:
    {{- if eq $hpa.metric.type "External" }}
    - type: External
      external:
        metric:
          name: {{ $hpa.metric.name }}
          selector:
            {{- if $hpa.metric.selector }}
            {{- toYaml $hpa.metric.selector | nindent 12 }}
            {{- else }}
            matchLabels:
              service: {{ include "cedserve.routerName" $root }}-metrics
            {{- end }}
        target:
          type: AverageValue
          averageValue: {{ $hpa.metric.targetAverageValue | quote }}
    {{- else }}
    - type: Pods
      pods:
        metric:
          name: {{ $hpa.metric.name }}
        target:
          type: AverageValue
          averageValue: {{ $hpa.metric.targetAverageValue | quote }}
    {{- end }}
  {{- with $hpa.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
NetworkPolicy of a pool: internal gRPC, NIXL and the UCX TCP range only from this release's pods;
every port from the same pool's pods (torch.distributed/NCCL/Gloo open ephemeral sockets inside a
group); metrics from `networkPolicy.metricsFrom`.
*/}}
{{- define "cedserve.pool.networkPolicy" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .role -}}
{{- $ctx := dict "root" $root "component" .role -}}
{{- $ucx := splitList "-" $v.ucxPortRange -}}
{{- if gt (index $ucx 0 | int) (index $ucx 1 | int) }}
{{- fail (printf "%s.ucxPortRange %q: the first port is above the last" .role $v.ucxPortRange) }}
{{- end -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "cedserve.poolName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "cedserve.selectorLabels" $ctx | nindent 6 }}
  policyTypes:
    - Ingress
  ingress:
    - from:
        - podSelector:
            matchLabels:
              {{- include "cedserve.releaseSelectorLabels" $root | nindent 14 }}
      ports:
        - port: {{ $v.ports.grpc }}
          protocol: TCP
        - port: {{ $v.ports.nixl }}
          {{- if gt (int $v.gpusPerPod) 1 }}
          endPort: {{ add $v.ports.nixl $v.gpusPerPod -1 }}
          {{- end }}
          protocol: TCP
        - port: {{ index $ucx 0 | int }}
          endPort: {{ index $ucx 1 | int }}
          protocol: TCP
    - from:
        - podSelector:
            matchLabels:
              {{- include "cedserve.selectorLabels" $ctx | nindent 14 }}
    {{- include "cedserve.metricsIngress" (dict "root" $root "port" $v.ports.metrics) | nindent 4 }}
{{- end }}

{{/*
Names, labels and pieces shared by every component. Pool (prefill/decode) templates live in
_pool.tpl and take a context built by `cedserve.poolContext`.
*/}}

{{- define "cedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select this release's pods, whatever their component. */}}
{{- define "cedserve.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "cedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component. Context: (dict "root" $ "component" "router|prefill|decode|test"). */}}
{{- define "cedserve.selectorLabels" -}}
{{ include "cedserve.releaseSelectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects. Context: (dict "root" $ "component" ...). */}}
{{- define "cedserve.labels" -}}
helm.sh/chart: {{ include "cedserve.chart" .root }}
{{ include "cedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: cedserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of a component's pods: no chart or app version, so that a chart upgrade that changes nothing
in the pod does not restart GPU workers (which reload the checkpoint). Context as cedserve.labels.
*/}}
{{- define "cedserve.podLabels" -}}
{{ include "cedserve.selectorLabels" . }}
app.kubernetes.io/part-of: cedserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "cedserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cedserve.routerName" -}}
{{- printf "%s-router" (include "cedserve.fullname" .) }}
{{- end }}

{{- define "cedserve.routerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cedserve.routerName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cedserve.configMapName" -}}
{{- printf "%s-config" (include "cedserve.fullname" .) }}
{{- end }}

{{- define "cedserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "cedserve.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{/* Name of a pool's workload (LeaderWorkerSet or StatefulSet). Context: (dict "root" $ "role" ...). */}}
{{- define "cedserve.poolName" -}}
{{- printf "%s-%s" (include "cedserve.fullname" .root | trunc 32 | trimSuffix "-") .role }}
{{- end }}

{{/* Headless Service of a pool: router discovery (EndpointSlices), StatefulSet pod DNS, metrics. */}}
{{- define "cedserve.poolHeadlessName" -}}
{{- printf "%s-headless" (include "cedserve.poolName" .) }}
{{- end }}

{{/* "LeaderWorkerSet" or "StatefulSet", from `groupWorkload` and the cluster's APIs. */}}
{{- define "cedserve.groupWorkload" -}}
{{- if eq .Values.groupWorkload "auto" }}
{{- if .Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1" }}LeaderWorkerSet{{ else }}StatefulSet{{ end }}
{{- else }}
{{- .Values.groupWorkload }}
{{- end }}
{{- end }}

{{/*
DNS name of a pool's group-0 leader (the pod the helm test targets).
LeaderWorkerSet names pods `<lws>-<group>` under a headless Service named after the LWS;
the StatefulSet fallback names them `<sts>-<ordinal>` under the pool's headless Service.
*/}}
{{- define "cedserve.poolLeader0Host" -}}
{{- $ns := .root.Release.Namespace }}
{{- $domain := .root.Values.clusterDomain }}
{{- $pool := include "cedserve.poolName" . }}
{{- if eq (include "cedserve.groupWorkload" .root) "LeaderWorkerSet" }}
{{- printf "%s-0.%s.%s.svc.%s" $pool $pool $ns $domain }}
{{- else }}
{{- printf "%s-0.%s.%s.svc.%s" $pool (include "cedserve.poolHeadlessName" .) $ns $domain }}
{{- end }}
{{- end }}

{{/* The checkpoint volume (nothing when the model is a preset). */}}
{{- define "cedserve.checkpointVolume" -}}
{{- $ckpt := .Values.model.checkpoint -}}
{{- if eq $ckpt.source "pvc" -}}
- name: checkpoint
  persistentVolumeClaim:
    claimName: {{ printf "%s-checkpoint" (include "cedserve.fullname" .) }}
    readOnly: true
{{- else if eq $ckpt.source "existingClaim" -}}
- name: checkpoint
  persistentVolumeClaim:
    claimName: {{ required "model.checkpoint.existingClaim is required when model.checkpoint.source is existingClaim" $ckpt.existingClaim }}
    readOnly: true
{{- else if eq $ckpt.source "hostPath" -}}
- name: checkpoint
  hostPath:
    path: {{ required "model.checkpoint.hostPath.path is required when model.checkpoint.source is hostPath" $ckpt.hostPath.path }}
    type: {{ $ckpt.hostPath.type }}
{{- end }}
{{- end }}

{{- define "cedserve.checkpointMount" -}}
{{- $ckpt := .Values.model.checkpoint -}}
{{- if ne $ckpt.source "none" -}}
- name: checkpoint
  mountPath: {{ $ckpt.mountPath }}
  readOnly: true
  {{- with $ckpt.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* `--checkpoint PATH` arguments (none when the model is a preset). */}}
{{- define "cedserve.checkpointArgs" -}}
{{- if ne .Values.model.checkpoint.source "none" }}
- --checkpoint={{ .Values.model.checkpoint.mountPath }}
{{- end }}
{{- end }}

{{/*
A ServeConfig TOML file. Context: (dict "root" $ "port" N "cache" MAP), MAP in values' camelCase.
Top-level keys come before the tables, as TOML requires.
*/}}
{{/*
The checkpoint folder the router reads (config.json for block hashing, tokenizer.json): the mounted
checkpoint, else the `router.modelFiles` volume; empty with a preset. Fails when the router would
see neither. The router's --checkpoint, its router.toml and its mounts all follow this one answer.
*/}}
{{- define "cedserve.routerCheckpoint" -}}
{{- $r := .Values.router -}}
{{- if ne .Values.model.checkpoint.source "none" -}}
{{- if $r.mountCheckpoint -}}
{{ .Values.model.checkpoint.mountPath }}
{{- else if $r.modelFiles -}}
{{ $r.modelFilesMountPath }}
{{- else -}}
{{- fail "router.mountCheckpoint is false but the router needs the checkpoint's config.json and tokenizer.json: set router.modelFiles to a volume holding them (or mount the checkpoint)" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* A process's ServeConfig TOML. Context: (dict "root" . "port" N "cache" MAP "tokenFile" PATH
["checkpoint" PATH]): `checkpoint` replaces `model.checkpoint.mountPath` (the router's own folder). */}}
{{- define "cedserve.serveToml" -}}
{{- $model := .root.Values.model -}}
host = "0.0.0.0"
port = {{ .port | int }}
{{- if .root.Values.workerToken.enabled }}
internal_token_file = {{ .tokenFile | toJson }}
{{- end }}
[model]
{{- if eq $model.checkpoint.source "none" }}
preset = {{ $model.preset | toJson }}
{{- else }}
checkpoint = {{ default $model.checkpoint.mountPath .checkpoint | toJson }}
engram = {{ $model.engram | toJson }}
{{- end }}
dtype = {{ $model.dtype | toJson }}
[cache]
block_size = {{ .cache.blockSize | int }}
num_blocks = {{ .cache.numBlocks | int }}
host_offload_blocks = {{ .cache.hostOffloadBlocks | int }}
{{- with .cache.diskDir }}
disk_dir = {{ . | toJson }}
{{- end }}
disk_capacity_blocks = {{ .cache.diskCapacityBlocks | int }}
disk_write_through = {{ .cache.diskWriteThrough }}
disk_fsync = {{ .cache.diskFsync }}
io_queue_depth = {{ .cache.ioQueueDepth | int }}
event_replay_batches = {{ .cache.eventReplayBatches | int }}
{{- end }}

{{/*
A TOML table `[<name>]` from a map: its scalar keys in order, values as TOML scalars (JSON strings
are TOML basic strings), then each map-valued key as the table `[<name>.<key>]`, recursively.
Context: (dict "name" NAME "table" MAP).
*/}}
{{- define "cedserve.tomlTable" -}}
[{{ .name }}]
{{- $t := .table }}
{{- range $key := keys $t | sortAlpha }}
{{- $v := index $t $key }}
{{- if not (kindIs "map" $v) }}
{{ $key }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- range $key := keys $t | sortAlpha }}
{{- $v := index $t $key }}
{{- if kindIs "map" $v }}
{{ include "cedserve.tomlTable" (dict "name" (printf "%s.%s" $.name $key) "table" $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A worker's engine table: `[<role>]` from `<role>.engine`. `device` defaults to the pod's GPU (each
rank sees its one GPU as device 0), else the CPU. Context: (dict "role" "prefill"|"decode" "pool" <the pool's values>).
*/}}
{{- define "cedserve.engineToml" -}}
{{- $engine := deepCopy (default dict .pool.engine) -}}
{{- if not (hasKey $engine "device") }}
{{- $_ := set $engine "device" (ternary "cuda:0" "cpu" (gt (int .pool.gpusPerPod) 0)) }}
{{- end -}}
{{ include "cedserve.tomlTable" (dict "name" .role "table" $engine) }}
{{- end }}

{{/*
Native gRPC probe. Context: (dict "port" N "service" NAME "probe" {periodSeconds, failureThreshold, timeoutSeconds}).
*/}}
{{- define "cedserve.grpcProbe" -}}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
{{- end }}

{{/* The three probes of a gRPC process. Context: (dict "port" N "probes" MAP). */}}
{{- define "cedserve.grpcProbes" -}}
startupProbe:
  {{- include "cedserve.grpcProbe" (dict "port" .port "service" "" "probe" .probes.startup) | nindent 2 }}
readinessProbe:
  {{- include "cedserve.grpcProbe" (dict "port" .port "service" "" "probe" .probes.readiness) | nindent 2 }}
livenessProbe:
  {{- include "cedserve.grpcProbe" (dict "port" .port "service" "liveness" "probe" .probes.liveness) | nindent 2 }}
{{- end }}

{{/*
preStop drain + grace period check. Context: (dict "port" N "drain" MAP "grace" N "what" NAME).
`cedserve drain` is accepted only from loopback, so it is safe on the public port too.
*/}}
{{- define "cedserve.preStopDrain" -}}
lifecycle:
  preStop:
    exec:
      command:
        - cedserve
        - drain
        - --address=127.0.0.1:{{ .port }}
        - --timeout-s={{ .drain.timeoutSeconds }}
{{- if ge (int .drain.timeoutSeconds) (int .grace) }}
{{- fail (printf "%s.drain.timeoutSeconds (%v) must be below %s.terminationGracePeriodSeconds (%v)" .what .drain.timeoutSeconds .what .grace) }}
{{- end }}
{{- end }}

{{/* Downward-API environment every cedserve process gets. */}}
{{- define "cedserve.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* PodDisruptionBudget. Context: (dict "root" $ "component" C "name" N "pdb" MAP). */}}
{{- define "cedserve.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "cedserve.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "cedserve.selectorLabels" . | nindent 6 }}
{{- end }}

{{/* NetworkPolicy ingress rule for a metrics port. Context: (dict "root" $ "port" N). */}}
{{- define "cedserve.metricsIngress" -}}
- ports:
    - port: {{ .port }}
      protocol: TCP
  {{- with .root.Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
TLS. A plane (`public`: the router's API; `internal`: router <-> workers and the KV-transfer control
plane) is one Secret (tls.crt, tls.key, ca.crt) mounted at /var/run/cedserve-tls/<plane> and named
in the config files. Kubelet gRPC probes cannot speak TLS, so a process whose gRPC port is TLS also
opens `ports.health` (plaintext: health and the loopback-only Drain only) for probes and preStop.
*/}}
{{- define "cedserve.tlsDir" -}}
/var/run/cedserve-tls/{{ . }}
{{- end }}

{{/* A `[tls]` or `[internal_tls]` table. Context: (dict "root" $ "plane" "public|internal"). */}}
{{- define "cedserve.tlsToml" -}}
{{- $t := index .root.Values.tls .plane -}}
{{- $dir := include "cedserve.tlsDir" .plane -}}
[{{ ternary "tls" "internal_tls" (eq .plane "public") }}]
cert = "{{ $dir }}/tls.crt"
key = "{{ $dir }}/tls.key"
{{- if or $t.requireClientCert (eq .plane "internal") }}
ca = "{{ $dir }}/ca.crt"
{{- end }}
require_client_cert = {{ $t.requireClientCert }}
{{- with $t.serverName }}
server_name = {{ . | toJson }}
{{- end }}
{{- end }}

{{/* volumeMounts / volumes of the enabled planes among `planes`. Context: (dict "root" $ "planes" LIST). */}}
{{- define "cedserve.tlsMounts" -}}
{{- range .planes }}
{{- if (index $.root.Values.tls .).enabled }}
- name: tls-{{ . }}
  mountPath: {{ include "cedserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "cedserve.tlsVolumes" -}}
{{- range .planes }}
{{- $t := index $.root.Values.tls . }}
{{- if $t.enabled }}
- name: tls-{{ . }}
  secret:
    secretName: {{ $t.secretName }}
    defaultMode: 0400
{{- end }}
{{- end }}
{{- end }}

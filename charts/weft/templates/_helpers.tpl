{{/* The node image: <registry>/<repository>:<tag>, the tag the chart's appVersion unless set; with image.digest,
<registry>/<repository>@<digest>: what was verified is what runs, whatever the tag points at later. */}}
{{- define "weft.image" -}}
{{- $repo := .Values.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repo = printf "%s/%s" .Values.image.registry .Values.image.repository -}}
{{- end -}}
{{- with .Values.image.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .) -}}
{{- fail (printf "image.digest %q is not a digest: sha256: and 64 lowercase hex digits, as the registry gives it" .) -}}
{{- end -}}
{{ printf "%s@%s" $repo . }}
{{- else -}}
{{ printf "%s:%s" $repo ($.Values.image.tag | default $.Chart.AppVersion) }}
{{- end -}}
{{- end -}}

{{- define "weft.namespace" -}}
{{ required "namespace.name is required" .Values.namespace.name }}
{{- end -}}

{{/* A container's image and pull policy. */}}
{{- define "weft.imageFields" -}}
image: {{ include "weft.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* What the read-only containers that act on the host's root-owned files run as: root, nothing else. */}}
{{- define "weft.rootNoCaps" -}}
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The node's name from the downward API, and the kubelet's kubeconfig for mesh-identity. */}}
{{- define "weft.meshIdentityEnv" -}}
- name: WEFT_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: WEFT_KUBELET_KUBECONFIG
  value: {{ .Values.nodes.kubeletKubeconfig }}
{{- end -}}

{{- define "weft.meshIdentityMounts" -}}
- name: mesh-identity
  mountPath: /etc/weft/mesh
- name: kubelet-kubeconfig
  mountPath: {{ .Values.nodes.kubeletKubeconfig }}
  readOnly: true
- name: kubelet-pki
  mountPath: {{ .Values.nodes.kubeletPKI }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/*
kernelcache.name: the chart name, overridable, cut to 63 characters because it ends up in
label values, which Kubernetes limits to 63.
*/}}
{{- define "kernelcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
kernelcache.fullname: the prefix of every resource name. The release name alone when it
already contains the chart name, so `helm install kernelcache` does not yield
"kernelcache-kernelcache"; cut to 63 characters for DNS-label names (Services).
*/}}
{{- define "kernelcache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kernelcache.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
kernelcache.labels: the labels on every resource; the selector labels plus version and
manager, so `kubectl get -l app.kubernetes.io/instance=<release>` finds all of it.
*/}}
{{- define "kernelcache.labels" -}}
{{ include "kernelcache.componentLabels" (list . "operator") }}
{{- end -}}

{{/*
kernelcache.componentLabels (list $ COMPONENT): the same labels for what belongs to another
component than the operator: the serving pods' PodMonitor is "serving", so that
`-l app.kubernetes.io/component=operator` selects the operator's own resources only.
*/}}
{{- define "kernelcache.componentLabels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $.Chart.Name $.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kernelcache.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/part-of: kernelcache
{{- with $.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
kernelcache.selectorLabels: the immutable subset used by the Deployment's selector and the
Services; it must never change between chart versions or upgrades break.
*/}}
{{- define "kernelcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kernelcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/*
kernelcache.serviceAccountName: the ServiceAccount the operator runs as; an existing one must
be named when the chart does not create it, else the pod would silently run as "default".
*/}}
{{- define "kernelcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kernelcache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
kernelcache.image: repository plus digest (preferred: immutable) or tag (default appVersion).
*/}}
{{- define "kernelcache.image" -}}
{{- $repository := required "image.repository is required" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
kernelcache.webhook.serviceName: the Service the webhook configurations call; the serving
certificate must name it, so both sides take it from here.
*/}}
{{- define "kernelcache.webhook.serviceName" -}}
{{- printf "%s-webhook" (include "kernelcache.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
kernelcache.webhook.secretName: the kubernetes.io/tls Secret holding the serving certificate,
written by cert-manager or by this chart.
*/}}
{{- define "kernelcache.webhook.secretName" -}}
{{- printf "%s-webhook-tls" (include "kernelcache.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
kernelcache.webhook.selfSigned: the helm-generated CA and serving certificate as a dict
{ca, cert, key}, base64-encoded. Made once per render and cached on the root context: the
Secret and both webhook configurations are separate templates and must all see the same CA,
which separate genCA calls would not give. The Secret a previous install or upgrade wrote is
reused (cert-manager's chart convention, through `lookup`): a certificate generated anew at
every `helm upgrade` would put a caBundle in the webhook configurations that the running
operator's certificate does not match until its pods rolled, and every labelled pod created
meanwhile would be refused (failurePolicy Fail) or admitted without its init-container
(Ignore). Delete the Secret to have the next upgrade make a new one (docs/operations.md).
*/}}
{{- define "kernelcache.webhook.selfSigned" -}}
{{- if not (hasKey $ "kernelcacheWebhookTLS") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kernelcache.webhook.secretName" .) -}}
{{- $data := (($existing | default dict).data | default dict) -}}
{{- if and (index $data "ca.crt") (index $data "tls.crt") (index $data "tls.key") -}}
{{- $_ := set $ "kernelcacheWebhookTLS" (dict "ca" (index $data "ca.crt") "cert" (index $data "tls.crt") "key" (index $data "tls.key")) -}}
{{- else -}}
{{- $service := include "kernelcache.webhook.serviceName" . -}}
{{- $days := int .Values.webhook.selfSignedValidityDays -}}
{{- $dns := list $service (printf "%s.%s" $service .Release.Namespace) (printf "%s.%s.svc" $service .Release.Namespace) (printf "%s.%s.svc.cluster.local" $service .Release.Namespace) -}}
{{- $ca := genCA (printf "%s-ca" $service) $days -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $service .Release.Namespace) nil $dns $days $ca -}}
{{- $_ := set $ "kernelcacheWebhookTLS" (dict "ca" ($ca.Cert | b64enc) "cert" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- toJson (get $ "kernelcacheWebhookTLS") -}}
{{- end -}}

{{/*
kernelcache.webhook.clientConfig: how the API server reaches one webhook path; with
cert-manager the caBundle is left to its CA injector (the inject-ca-from annotation),
otherwise it is the helm-generated CA.
*/}}
{{- define "kernelcache.webhook.clientConfig" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- if not (has $path (list "/inject" "/validate")) -}}
{{- fail (printf "kernelcache.webhook.clientConfig: unknown webhook path %q" $path) -}}
{{- end -}}
service:
  name: {{ include "kernelcache.webhook.serviceName" $root }}
  namespace: {{ $root.Release.Namespace }}
  path: {{ $path }}
  port: 443
{{- if not $root.Values.certManager.enabled }}
caBundle: {{ (include "kernelcache.webhook.selfSigned" $root | fromJson).ca }}
{{- end }}
{{- end -}}

{{/*
kernelcache.webhook.annotations: cert-manager's CA injector fills caBundle from the
Certificate named here.
*/}}
{{- define "kernelcache.webhook.annotations" -}}
{{- if .Values.certManager.enabled -}}
cert-manager.io/inject-ca-from: {{ printf "%s/%s" .Release.Namespace (include "kernelcache.webhook.secretName" .) }}
{{- end -}}
{{- end -}}

{{/*
kernelcache.crdAnnotations: helm.sh/resource-policy keep when crds.keep, so that uninstalling
the release does not delete the CRDs and with them every KernelCache.
*/}}
{{- define "kernelcache.crdAnnotations" -}}
{{- if .Values.crds.keep -}}
helm.sh/resource-policy: keep
{{- end -}}
{{- end -}}

{{/*
kernelcache.validate: fails the render on values that contradict each other; included once
from the Deployment, which every install renders.
*/}}
{{- define "kernelcache.validate" -}}
{{- if and .Values.prometheus.servicemonitor.enabled (not .Values.prometheus.enabled) -}}
{{- fail "prometheus.servicemonitor.enabled needs prometheus.enabled (the metrics endpoint it scrapes)" -}}
{{- end -}}
{{- if and .Values.prometheus.podmonitor.enabled (not .Values.prometheus.enabled) -}}
{{- fail "prometheus.podmonitor.enabled needs prometheus.enabled (the switch of every Prometheus resource of the chart)" -}}
{{- end -}}
{{- if and .Values.prometheus.prometheusrule.enabled (not .Values.prometheus.enabled) -}}
{{- fail "prometheus.prometheusrule.enabled needs prometheus.enabled (its alerts read the metrics)" -}}
{{- end -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.operator.peering) -}}
{{- fail "replicaCount above 1 needs operator.peering: without it every replica reconciles at once" -}}
{{- end -}}
{{- $ports := list (int .Values.webhook.port) (int .Values.operator.livenessPort) -}}
{{- if .Values.prometheus.enabled -}}{{- $ports = append $ports (int .Values.operator.metricsPort) -}}{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail "webhook.port, operator.livenessPort and operator.metricsPort must differ" -}}
{{- end -}}
{{- range $name, $_ := .Values.operator.extraEnv -}}
{{- if has $name (list "KERNELCACHE_OPERATOR_NAMESPACES" "KERNELCACHE_OPERATOR_PEERING" "KERNELCACHE_OPERATOR_WORKERS" "KERNELCACHE_OPERATOR_RESYNC_SECONDS" "KERNELCACHE_OPERATOR_STORE_MOUNT_PATH" "KERNELCACHE_OPERATOR_INIT_IMAGE" "KERNELCACHE_OPERATOR_CLEANUP_IMAGE" "KERNELCACHE_OPERATOR_LIVENESS" "KERNELCACHE_OPERATOR_METRICS_PORT" "KERNELCACHE_OPERATOR_WEBHOOK_PORT" "KERNELCACHE_OPERATOR_WEBHOOK_TLS_DIR") -}}
{{- fail (printf "operator.extraEnv.%s is set by a dedicated value; set that instead" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Names and labels shared by every object of the release. */}}

{{- define "moe-proxy.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "moe-proxy.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "moe-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "moe-proxy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "moe-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moe-proxy
{{- end -}}

{{- define "moe-proxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "moe-proxy.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "moe-proxy.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
The RBAC rules from files/rbac-rules.yaml (generated from the operator's rbac.PERMISSIONS)
that this configuration needs, as a YAML list of rule objects. A rule with `features` is
kept only when one of those features is enabled in the values.
Call with (dict "root" $ "scope" "all"|"cluster"|"namespaced").
*/}}
{{- define "moe-proxy.rbacRules" -}}
{{- $root := .root -}}
{{- $enabled := dict "preflight" $root.Values.operator.preflight "checkpointWatch" $root.Values.checkpointWatch.enabled -}}
{{- range $name, $runtime := $root.Values.runtimes -}}
{{- $_ := set $enabled $name $runtime.enabled -}}
{{- end -}}
{{- $file := $root.Files.Get "files/rbac-rules.yaml" | fromYaml -}}
{{- if not $file.rules -}}
{{- fail "files/rbac-rules.yaml has no rules: run python charts/generate_rbac.py" -}}
{{- end -}}
{{- $out := list -}}
{{- range $file.rules -}}
{{- $wanted := not .features -}}
{{- range .features -}}
{{- if not (hasKey $enabled .) -}}
{{- fail (printf "files/rbac-rules.yaml: unknown feature %q" .) -}}
{{- end -}}
{{- if get $enabled . -}}
{{- $wanted = true -}}
{{- end -}}
{{- end -}}
{{- $inScope := or (eq $.scope "all") (and .clusterScoped (eq $.scope "cluster")) (and (not .clusterScoped) (eq $.scope "namespaced")) -}}
{{- if and $wanted $inScope -}}
{{- $out = append $out (dict "apiGroups" (list .apiGroup) "resources" (list .resource) "verbs" .verbs) -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
The reproduction runtimes the operator serves (MOEPROXY_RUNTIMES): batch/v1 Job always, then
each runtime whose runtimes.<name>.enabled is true, by its spec.reproduction.runtime name.
*/}}
{{- define "moe-proxy.runtimes" -}}
{{- $names := dict "volcanoJob" "VolcanoJob" "ascendJob" "AscendJob" "rayJob" "RayJob" "trainJob" "TrainJob" "jobSet" "JobSet" -}}
{{- $out := list "Job" -}}
{{- range $key := list "volcanoJob" "ascendJob" "rayJob" "trainJob" "jobSet" -}}
{{- if (get $.Values.runtimes $key).enabled -}}
{{- $out = append $out (get $names $key) -}}
{{- end -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

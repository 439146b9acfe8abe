package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
)

// withReferrersSpec adds to pkg/registry what distribution-spec 1.1 asks of a registry with the referrers API
// and it lacks (see main.go): the OCI-Subject header, artifactType from the manifest, ?artifactType= filtering.
func withReferrersSpec(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPut && strings.Contains(r.URL.Path, "/manifests/"):
			putManifest(next, w, r)
		case r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/referrers/"):
			listReferrers(next, w, r)
		default:
			next.ServeHTTP(w, r)
		}
	})
}

type manifestFields struct {
	ArtifactType string `json:"artifactType"`
	Subject      *struct {
		Digest string `json:"digest"`
	} `json:"subject"`
}

func putManifest(next http.Handler, w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	var doc manifestFields
	if json.Unmarshal(body, &doc) == nil && doc.Subject != nil && doc.Subject.Digest != "" {
		w.Header().Set("OCI-Subject", doc.Subject.Digest)
	}
	next.ServeHTTP(w, r)
}

func listReferrers(next http.Handler, w http.ResponseWriter, r *http.Request) {
	want := r.URL.Query().Get("artifactType")
	rec := httptest.NewRecorder()
	next.ServeHTTP(rec, r)
	var index struct {
		SchemaVersion int              `json:"schemaVersion"`
		MediaType     string           `json:"mediaType"`
		Manifests     []map[string]any `json:"manifests"`
	}
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &index) != nil {
		copyResponse(w, rec)
		return
	}
	repo := r.URL.Path[:strings.Index(r.URL.Path, "/referrers/")] // /v2/<name>
	kept := []map[string]any{}
	for _, desc := range index.Manifests {
		digest, _ := desc["digest"].(string)
		get := httptest.NewRequest(http.MethodGet, repo+"/manifests/"+digest, nil)
		got := httptest.NewRecorder()
		next.ServeHTTP(got, get)
		var doc manifestFields
		if got.Code == http.StatusOK && json.Unmarshal(got.Body.Bytes(), &doc) == nil && doc.ArtifactType != "" {
			desc["artifactType"] = doc.ArtifactType
		}
		if want == "" || desc["artifactType"] == want {
			kept = append(kept, desc)
		}
	}
	index.Manifests = kept
	out, _ := json.Marshal(index)
	if want != "" {
		w.Header().Set("OCI-Filters-Applied", "artifactType")
	}
	w.Header().Set("Content-Type", index.MediaType)
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(out)
}

func copyResponse(w http.ResponseWriter, rec *httptest.ResponseRecorder) {
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write(rec.Body.Bytes())
}

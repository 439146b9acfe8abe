module weft.local/ociregistry

go 1.25.0

require github.com/google/go-containerregistry v0.22.1

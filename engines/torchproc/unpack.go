package torchproc

import (
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/slimen/slimen/engines/torch"
)

// unpack writes the embedded worker package into the user's cache folder, once per version of its
// contents, and returns the folder to put on PYTHONPATH.
func unpack() (string, error) {
	h := sha256.New()
	var files []string
	err := fs.WalkDir(torch.Package, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(torch.Package, p)
		if err != nil {
			return err
		}
		h.Write([]byte(p))
		h.Write(b)
		files = append(files, p)
		return nil
	})
	if err != nil {
		return "", err
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "slimen", "torch-worker-"+hex.EncodeToString(h.Sum(nil))[:16])
	if _, err := os.Stat(filepath.Join(dir, "slimen_torch", "__init__.py")); err == nil {
		return dir, nil
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return "", err
	}
	// Written aside and renamed into place, so that a concurrent start never sees half a package.
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".unpack-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for _, p := range files {
		b, _ := fs.ReadFile(torch.Package, p)
		dst := filepath.Join(tmp, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return "", err
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		if _, statErr := os.Stat(filepath.Join(dir, "slimen_torch", "__init__.py")); statErr == nil {
			return dir, nil // another process won the race
		}
		return "", err
	}
	return dir, nil
}

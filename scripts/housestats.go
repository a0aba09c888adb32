//go:build ignore

// Housestats measures the shape of the module's Go code: function
// lengths (p50, p90, max) over the non-test files of host/ and of the
// whole module, the largest files, the types with the most methods (with
// their fields and the files their methods span), and the host comments
// that name another Go file.
//
// Run it from the repository root:
//
//	go run scripts/housestats.go
package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// file is one parsed non-test Go file.
type file struct {
	path  string
	dir   string
	lines int
	ast   *ast.File
}

// fn is one function or method with its length in lines.
type fn struct {
	name  string
	where string
	lines int
}

// typeStats counts a type's methods and the files they are in.
type typeStats struct {
	name    string
	methods int
	files   map[string]bool
	fields  int
}

func main() {
	fset := token.NewFileSet()
	var files []file
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || strings.HasPrefix(path, "scripts/") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return fmt.Errorf("parse %s: %w", path, err)
		}
		files = append(files, file{path: path, dir: filepath.Dir(path), lines: fset.Position(f.FileEnd).Line, ast: f})
		return nil
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "housestats:", err)
		os.Exit(1)
	}

	var host, all []fn
	for _, f := range files {
		for _, d := range f.ast.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			n := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1
			name := fd.Name.Name
			if fd.Recv != nil && len(fd.Recv.List) > 0 {
				name = recvName(fd.Recv.List[0].Type) + "." + name
			}
			x := fn{name: name, where: f.path, lines: n}
			all = append(all, x)
			if f.dir == "host" {
				host = append(host, x)
			}
		}
	}
	fmt.Println("# function length (lines, non-test files)")
	fmt.Printf("%-10s %6s %5s %5s %5s  %s\n", "scope", "funcs", "p50", "p90", "max", "longest")
	for _, s := range []struct {
		name string
		fns  []fn
	}{{"host/", host}, {"module", all}} {
		p50, p90, max, longest := quantiles(s.fns)
		fmt.Printf("%-10s %6d %5d %5d %5d  %s\n", s.name, len(s.fns), p50, p90, max, longest)
	}

	fmt.Println("\n# ten longest functions in host/")
	sort.Slice(host, func(i, j int) bool { return host[i].lines > host[j].lines })
	for _, x := range host[:min(10, len(host))] {
		fmt.Printf("%5d  %s (%s)\n", x.lines, x.name, x.where)
	}

	fmt.Println("\n# ten largest Go files (non-test)")
	sort.Slice(files, func(i, j int) bool { return files[i].lines > files[j].lines })
	for _, f := range files[:min(10, len(files))] {
		fmt.Printf("%5d  %s\n", f.lines, f.path)
	}

	fmt.Println("\n# ten largest files in host/ (non-test)")
	n := 0
	for _, f := range files {
		if f.dir == "host" && n < 10 {
			fmt.Printf("%5d  %s\n", f.lines, f.path)
			n++
		}
	}

	fmt.Println("\n# methods per type (top 12; fields of its struct, files its methods are in)")
	types := map[string]*typeStats{}
	get := func(key string) *typeStats {
		t := types[key]
		if t == nil {
			t = &typeStats{name: key, files: map[string]bool{}}
			types[key] = t
		}
		return t
	}
	for _, f := range files {
		for _, d := range f.ast.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil || len(d.Recv.List) == 0 {
					continue
				}
				t := get(f.dir + "." + recvName(d.Recv.List[0].Type))
				t.methods++
				t.files[filepath.Base(f.path)] = true
			case *ast.GenDecl:
				for _, s := range d.Specs {
					ts, ok := s.(*ast.TypeSpec)
					if !ok {
						continue
					}
					if st, ok := ts.Type.(*ast.StructType); ok {
						nf := 0
						for _, fl := range st.Fields.List {
							nf += max(1, len(fl.Names))
						}
						get(f.dir + "." + ts.Name.Name).fields = nf
					}
				}
			}
		}
	}
	var ts []*typeStats
	for _, t := range types {
		if t.methods > 0 {
			ts = append(ts, t)
		}
	}
	sort.Slice(ts, func(i, j int) bool {
		if ts[i].name == "host.Run" || ts[j].name == "host.Run" {
			return ts[i].name == "host.Run"
		}
		if ts[i].methods != ts[j].methods {
			return ts[i].methods > ts[j].methods
		}
		return ts[i].name < ts[j].name
	})
	fmt.Printf("%-40s %7s %6s %5s\n", "type", "methods", "fields", "files")
	for _, t := range ts[:min(12, len(ts))] {
		fmt.Printf("%-40s %7d %6d %5d\n", t.name, t.methods, t.fields, len(t.files))
	}

	fmt.Println("\n# host/ comments that name another Go file")
	re := regexp.MustCompile(`\b[a-z_]+\.go\b`)
	count := 0
	for _, f := range files {
		if f.dir != "host" {
			continue
		}
		for _, cg := range f.ast.Comments {
			for _, c := range cg.List {
				for _, m := range re.FindAllString(c.Text, -1) {
					if m != filepath.Base(f.path) {
						count++
					}
				}
			}
		}
	}
	fmt.Println(count)

	fmt.Println("\n# doc comments that do not start with their name (non-test files)")
	var odd []string
	for _, f := range files {
		if strings.HasSuffix(f.path, ".pb.go") {
			continue // generated
		}
		for _, d := range f.ast.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if !docStartsWith(d.Doc, d.Name.Name) {
					odd = append(odd, f.path+": "+d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					ts, ok := s.(*ast.TypeSpec)
					if !ok {
						continue
					}
					doc := ts.Doc
					if doc == nil && len(d.Specs) == 1 {
						doc = d.Doc
					}
					if !docStartsWith(doc, ts.Name.Name) {
						odd = append(odd, f.path+": "+ts.Name.Name)
					}
				}
			}
		}
	}
	fmt.Println(len(odd))
	for _, o := range odd[:min(10, len(odd))] {
		fmt.Println("  " + o)
	}
}

// docStartsWith says whether a doc comment, if there is one, starts with name (or with "A", "An"
// or "The" and then name, as Go's own doc comments may).
func docStartsWith(doc *ast.CommentGroup, name string) bool {
	if doc == nil {
		return true
	}
	words := strings.Fields(doc.Text())
	if len(words) > 1 && (words[0] == "A" || words[0] == "An" || words[0] == "The") {
		words = words[1:]
	}
	if len(words) == 0 {
		return false
	}
	w := strings.TrimRight(words[0], ".,:;")
	return w == name || strings.HasPrefix(w, name+"'")
}

// recvName is the type name of a method receiver.
func recvName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return recvName(e.X)
	case *ast.IndexExpr:
		return recvName(e.X)
	case *ast.IndexListExpr:
		return recvName(e.X)
	case *ast.Ident:
		return e.Name
	}
	return "?"
}

// quantiles is the median, 90th percentile and maximum length of fns,
// with the name of the longest.
func quantiles(fns []fn) (p50, p90, max int, longest string) {
	if len(fns) == 0 {
		return 0, 0, 0, ""
	}
	s := append([]fn(nil), fns...)
	sort.Slice(s, func(i, j int) bool { return s[i].lines < s[j].lines })
	at := func(q float64) int { return s[int(q*float64(len(s)-1)+0.5)].lines }
	last := s[len(s)-1]
	return at(0.5), at(0.9), last.lines, last.name + " (" + last.where + ")"
}

// Tokenize .mesh files with VS Code's own TextMate engine (vscode-textmate + Oniguruma) and print,
// per file, every token as [line, start, end, innermost scope]. tests/lsp/test_textmate.py compares
// this with its Python reading of the same grammar when node and the dev dependencies are present.
//   node scripts/tokenize.js FILE...
const fs = require("fs");
const path = require("path");
const vsctm = require("vscode-textmate");
const oniguruma = require("vscode-oniguruma");

const wasm = fs.readFileSync(path.join(require.resolve("vscode-oniguruma"), "..", "onig.wasm")).buffer;
const onigLib = oniguruma.loadWASM(wasm).then(() => ({
  createOnigScanner: (patterns) => new oniguruma.OnigScanner(patterns),
  createOnigString: (s) => new oniguruma.OnigString(s),
}));
const grammarPath = path.join(__dirname, "..", "syntaxes", "mesh.tmLanguage.json");
const registry = new vsctm.Registry({
  onigLib,
  loadGrammar: async (scope) =>
    scope === "source.mesh" ? vsctm.parseRawGrammar(fs.readFileSync(grammarPath, "utf8"), grammarPath) : null,
});

registry.loadGrammar("source.mesh").then((grammar) => {
  const out = {};
  for (const file of process.argv.slice(2)) {
    const lines = fs.readFileSync(file, "utf8").split("\n");
    let state = vsctm.INITIAL;
    const toks = [];
    lines.forEach((line, i) => {
      const r = grammar.tokenizeLine(line, state);
      for (const t of r.tokens) {
        const scope = t.scopes[t.scopes.length - 1];
        if (scope !== "source.mesh") toks.push([i, t.startIndex, t.endIndex, scope]);
      }
      state = r.ruleStack;
    });
    out[file] = toks;
  }
  process.stdout.write(JSON.stringify(out));
});

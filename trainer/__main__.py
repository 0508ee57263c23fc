from trainer.train import main

main()
